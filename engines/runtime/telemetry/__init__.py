"""What the engine reports: the event trace recorder, its Chrome-trace exporters, and engine
metrics. Used by every room; imports none of them."""
