"""Pipeline stages (SFT, reward model; PPO and MA-PPO later), each a thin layer over trl/peft.

Configs are trl's own dataclasses (`SFTConfig`, `RewardConfig`, `ModelConfig`)
plus one small dataclass of ours per stage, parsed from YAML with command-line
overrides by trl's `TrlParser`, exactly as trl's scripts do.
"""
