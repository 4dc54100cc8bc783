"""The lookup past misses: reuse every cached span block of a prompt, compute only the holes.

Scheduler side (EngineCore): ``scheduler_lookup`` finds cached runs after the first miss and
attaches them; ``scheduler_steps`` takes every hole that fits one engine step. Worker side:
``worker_positions`` gives each hole token its true position in the model runner.
"""
