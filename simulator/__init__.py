"""specsim's simulator: pure Python (SimPy, numpy, pandas); never imports torch."""
