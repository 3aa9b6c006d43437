"""One run: the plugin class (the phase machine and the hook implementations) and the small
objects it delegates to (mechanisms, capture bookkeeping, the forward/backward interceptor,
guard, fallback, measurement, report, release). Talks to megatron-core only through
``compat``.
"""
