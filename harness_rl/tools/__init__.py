"""Tools around an engine: `doctor` (is an engine set up for exact capture?) and `vllm_server` (starting
vLLM with the flags exact capture needs). Light: neither imports torch at module level.
"""
