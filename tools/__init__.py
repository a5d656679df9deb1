"""The `wren` command line and the helpers it runs (brokers, the virtual board, the demo)."""
