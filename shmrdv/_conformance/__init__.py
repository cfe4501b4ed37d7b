"""The conformance battery behind ``shmrdv.testing`` (which is its public face).

``pair``: what a check runs on and how long it waits; ``values``: the values every transport
must carry, compared byte for byte; ``tools``: the bounded waits and recorders the checks
share; ``delivery`` and ``completion``: the checks themselves.
"""
