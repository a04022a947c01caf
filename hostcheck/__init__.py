"""Host probes and the power/clock sampler (imports nothing from `appliance`).

The probes themselves are the host-checker issue's work; this package exists now so the
distribution's layout is the one every later issue builds on.
"""
