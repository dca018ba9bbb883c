"""The run level: a run's configuration composed from each part's settings (`config`, `presets`,
`preflight`), the stack it stands on (`engines`, `stack`, `proxy_gate`), rollouts (`rollouts`), the
training loop (`train`), evaluation (`evaluate`), and what a run leaves on disk (`run_files`, `metrics`,
`report`). It may use every part below it; nothing below imports it, and it never imports the demo.
"""
