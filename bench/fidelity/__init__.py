"""Modes against full prefill: TTFT, deviation, task accuracy, and their floors."""
