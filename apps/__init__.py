"""Applications over the runtime: greedy generation (generate), many sequences over a
model's slots (scheduler) and an OpenAI-compatible server (serve). They run a session of
either executor (runtime/executor.py) and import nothing from the compiler."""
