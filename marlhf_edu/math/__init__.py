"""The math of RLHF-PPO: tensors in, tensors out; torch only (the bottom layer with `marlhf_edu.errors`)."""
