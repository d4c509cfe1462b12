"""qevolve: self-evolving LLM agents for long-horizon text environments with in-distribution offline RL."""

__version__ = "0.1.0"
