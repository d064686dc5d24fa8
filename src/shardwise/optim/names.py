"""The optimizers and schedules shardwise builds (read by the config, the builders and the planner)."""

OPTIMIZER_NAMES = ("adamw", "muon", "adafactor", "sgd")
SCHEDULE_NAMES = ("cosine", "linear", "constant", "wsd")
# What a resume does when the checkpoint's optimizer is not the configured one.
ON_SWITCH = ("refuse", "reset")
MUON_LR_ADJUST = ("match_rms_adamw", "original")
