"""The commands of `marlhf-edu`, one module each (`main(argv)`); `marlhf_edu.cli` names them.

A command parses its arguments and calls the layers below it: the trl-backed stages in `marlhf_edu.training`,
the PPO engine in `marlhf_edu.ppo`, the planner in `marlhf_edu.memory`. No command imports another.
"""
