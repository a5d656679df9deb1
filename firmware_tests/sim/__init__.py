# Simulated MicroPython machine modules for board tests (network, machine): never
# shipped, never on a board's flash. See network.py.
