"""Plain-torch reference twins of every kernel: the CPU path, and the definition of what each
Triton kernel computes. Readability first; each file is one operation."""
