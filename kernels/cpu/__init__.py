"""The CPU side of ``kernels``: what torch and oneDNN offer on the host, chosen at run time by what
this machine supports (AVX-512, AVX-512 BF16, AMX), each with a plain-torch fallback."""
