"""The learner: traces in, gradient steps out, new weights pushed to the engine.

`rows` (traces → training rows), `grpo` (advantages and the loss), `samples`, `packing`, `learner`
(the synchronous step), `step_metrics` (what a step measured), `distributed` (torchrun ranks, FSDP2),
`lora` (peft adapters), `weight_source` (what a sync sends), `weight_sync` and `lora_sync` (getting
weights into an engine), `sync_check`, `checkpoint`, `sft`, and their settings in `config`. It never
imports the proxy, the adapters, the run level or the demo; the package itself imports nothing, so
`harness_rl.learner.config` stays light.
"""
