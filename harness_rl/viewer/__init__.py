"""`harness-rl view`: a run (or loose traces) as one self-contained HTML page.

`load.py` reads the run directory into the typed `View` (`model.py`), `tokens.py` finds and applies
the run's tokenizer offline, `page.py` inlines everything into one HTML file whose script
(`assets/viewer.js`) draws the charts, the reward map, the rollout list and each rollout's turns.
Nothing here imports torch or transformers.
"""
