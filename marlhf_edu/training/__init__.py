"""The trl-backed training stages as functions (SFT, reward model, DPO, GRPO), their arguments, rows, run
folders and the pipeline file; the commands in `marlhf_edu.stages` call them."""
