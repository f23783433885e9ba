"""Inputs: workloads (arrivals and lengths, traces), acceptance models, and the CSV checks they share."""
