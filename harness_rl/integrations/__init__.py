"""harness-rl inside other trainers: `trl` puts our sessions behind TRL's harness trainer.

Each module here imports its trainer's packages itself; nothing else in harness-rl imports them.
"""
