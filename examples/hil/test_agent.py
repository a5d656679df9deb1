"""Hardware-in-the-loop tests of the station agent (main.py), with Wren's pytest plugin.

    pytest                                   # the board on the MicroPython unix port
    pytest --wren-target serial:/dev/ttyACM0 --wren-broker-host 192.168.1.20 \\
           --wren-settings wifi.json         # a real board, on Wi-Fi
"""


def test_it_reads_the_sensor(wren_board, wren_host):
    run = wren_host.ask(wren_board.device, "How warm is it?")
    assert run.status == "done", run.error
    assert run.tools == ["read_temperature"]
    assert run.text.endswith("It is 21.5 °C here.")


def test_it_asks_the_user_first(wren_board, wren_host):
    req = wren_host.request(wren_board.device, "Open the vent if it is warm.")
    call = wren_host.wait_tool(req, "ask_user")  # the run waits for the answer
    assert call.args == {"q": "Open the vent?"}
    wren_host.answer(call, "yes")
    run = wren_host.wait(req)
    assert run.status == "done" and run.text.endswith("You said: yes")


def test_it_answers_after_a_reboot(wren_board, wren_host):
    before = wren_board.boot
    status = wren_board.reboot()  # back online, in a new boot
    assert status["boot"] != before and status["agent"] == "station"
    run = wren_host.ask(wren_board.device, "How warm is it?")
    assert run.status == "done", run.error
    # What the board said of its heap, between runs, stayed clear of running out.
    assert wren_board.min_free_heap() > 8 * 1024
