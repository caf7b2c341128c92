"""What a person runs beside sync and training: status, verify and gc, clear, plot, the demo, PSS measurement."""
