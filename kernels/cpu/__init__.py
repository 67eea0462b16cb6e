"""The CPU side of ``kernels``: what torch and oneDNN offer on the host, and native C kernels built
for this CPU's instruction set (``native/``, AVX-512, AVX2 or generic), chosen at run time, each with
a plain-torch fallback."""
