# Wren board runtime. Every module here imports and runs on MicroPython (unix port and
# boards) and unchanged on CPython, which is how the bridge tests and the virtual board
# run the very same code.
