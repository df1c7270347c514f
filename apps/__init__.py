"""Applications over the runtime: generation (generate), the choice of each token (sampling,
over libnpucrt's sampler), many sequences over a model's slots (scheduler) and an
OpenAI-compatible server (serve, with openai_format for its text-level pieces). They run a session of
either executor (runtime/executor.py) and import nothing from the compiler."""
