"""sparkd — memory guard and cockpit for vLLM on NVIDIA DGX Spark (unified memory)."""

__version__ = "0.1.0"
