"""Set-up for every test (test_score_centering.py and tests/): pytest imports this file first,
so XLA_FLAGS is set before jax is imported and jax is configured before any test builds an array."""

import os
import tempfile

# 4 CPU devices for the sharding tests; the suite compiles many small programs and runs each a few
# times: XLA's CPU backend at optimisation level 0, without its fusion emitters, in one codegen
# module compiles them in a third of the time (measured: a short sequence run 18 s -> 9 s); its
# concurrency-optimised scheduler off: with it, a train step's collectives over the 4 devices could
# wait on each other until XLA aborted (seen in about half the sequence --compare runs)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"
)
# torch (transformers, the independent reference) on one thread: beside another busy process on 2
# cores, its second OpenMP thread waits for a core, and a small op takes ~5 ms, not 8 µs (measured)
os.environ.setdefault("OMP_NUM_THREADS", "1")
import jax  # after XLA_FLAGS: jax reads them when it starts

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_numpy_rank_promotion", "raise")  # implicit rank promotion raises
# the train.py tests compile the same programs run after run: keep them on disk for the session
# (one folder for xdist's workers of one run, which compile many of the same programs)
run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
cache = os.path.join(tempfile.gettempdir(), f"jax-cache-{run}") if run else tempfile.mkdtemp()
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
