"""The benchmarks ``run_all`` runs and ``report`` reads, in order: a module of its own so that
neither of the two imports the other."""

# (module, how it is told where to write: "results-dir" for ours, "out" for the service helper's)
REGISTRY: list[tuple[str, str]] = [
    ("kv_memory", "results-dir"),
    ("step_overhead", "results-dir"),
    ("compute_efficiency", "results-dir"),
    ("cpu_kernels", "results-dir"),
    ("chunked_prefill", "results-dir"),
    ("prefix_caching", "results-dir"),
    ("block_hashing", "results-dir"),
    ("continuous_batching", "results-dir"),
    ("peer", "results-dir"),
    ("serving", "out"),
    ("transports", "out"),
    ("tokenizer_workers", "out"),
    ("routing", "results-dir"),
    ("structured_output", "results-dir"),
    ("speculative", "results-dir"),
    ("lora", "results-dir"),
]
