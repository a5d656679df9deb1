# Runs board test modules on a MicroPython target. As a script on the unix port:
#   micropython -X heapsize=128K firmware_tests/runner.py firmware_tests.test_codec
# or through a board's raw REPL (tools/hil.py sends
# `from firmware_tests.runner import report; report("firmware_tests.test_codec")`).
# Each test_* function is called; the last line is "N passed, N failed" so both people
# and the pytest wrappers can read the outcome.
import sys

try:
    import gc
except ImportError:  # pragma: no cover
    gc = None


def run_module(name, only=None, setup=None):
    mod = __import__(name)
    for part in name.split(".")[1:]:
        mod = getattr(mod, part)
    if setup:
        # Names for firmware_tests.support (`wren hil`: BROKER, PREFIX), set once the
        # module is imported: its compile is the heap's peak, and support (with asyncio)
        # imported before it took 7 KB of that peak, which a 128K heap did not have.
        from firmware_tests import support
        for k in setup:
            setattr(support, k, setup[k])
    passed = failed = 0
    names = sorted(n for n in dir(mod) if n.startswith("test_"))
    for n in names:
        if only and n != only:
            continue
        fn = getattr(mod, n)
        if not callable(fn):
            continue
        if gc:
            gc.collect()
        try:
            fn()
            passed += 1
            print("PASS", n)
        except Exception as e:  # noqa: BLE001 - the runner reports every failure
            failed += 1
            print("FAIL", n, type(e).__name__, e)
            if hasattr(sys, "print_exception"):
                sys.print_exception(e)
    return passed, failed


def report(name, only=None, setup=None):
    passed, failed = run_module(name, only, setup)
    print("%d passed, %d failed" % (passed, failed))
    return passed, failed


def main():
    if len(sys.argv) < 2:
        print("usage: runner.py MODULE [TEST]")
        sys.exit(2)
    passed, failed = report(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    sys.exit(1 if failed or not passed else 0)


if __name__ == "__main__":
    main()
