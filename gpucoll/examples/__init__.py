"""Runnable examples: ``gpucoll run -n 4 -m gpucoll.examples.allreduce``."""
