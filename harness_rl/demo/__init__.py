"""The CPU demos: the models harness-rl builds offline (`models`), the teacher that drives a real agent
CLI with forced replies (`teacher`), and `tiny-agent`, warm-started on the teacher's traces
(`tiny_agent`). Nothing outside the faces imports it.
"""
