"""FlashLab: FlashAttention from first principles — the code the course's notebooks share."""

__version__ = "0.1.0"
