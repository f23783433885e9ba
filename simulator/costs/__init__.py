"""Costs: profile tables (measured or analytical seconds per pass) and the cost models fitted on them."""
