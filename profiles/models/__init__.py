"""The models both the profiler and the real engine run: shipped architecture configs (``*.json`` beside this
file), reading them (:mod:`.config`), the families built with transformers and reduced configs
(:mod:`.families`), the forward passes (:mod:`.forward`, eager and optimized) and the
checked draft/target pairs with their prompts (:mod:`.pairs`). Imports nothing else of ``profiles``."""
