"""The serve command as a process: it listens on 127.0.0.1 unless told otherwise; SIGTERM
finishes the requests in flight, then exits 0; a bad repository or a taken port is an
error message and exit status 1 before anything listens."""

import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
from serve_harness import TINY_SIZE, ServerProcess, add_tiny, wait_until


def _pending(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('nv_inference_pending_request_count{model="tiny"'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_right_after_the_address_is_announced_exits_0(tmp_path):
    # The announcement is the moment a caller may stop the server: a SIGTERM then, before
    # uvicorn has taken its signals over, must still end in a graceful exit, not kill the
    # process (-15) or be swallowed (a server that never stops).
    add_tiny(tmp_path, "yolov3-tiny", "max_batch_size: 1\n", size=64)
    for _ in range(3):
        with ServerProcess(tmp_path, "-q") as server:
            pass
        assert server.process.returncode == 0, server.log


def test_sigterm_finishes_the_request_in_flight_then_exits_0(tmp_path):
    # A 3 s queue delay keeps the request waiting in the batcher when SIGTERM arrives.
    add_tiny(tmp_path, config="max_batch_size: 8\n"
             "dynamic_batching { max_queue_delay_microseconds: 3000000 }\n")
    server = ServerProcess(tmp_path)
    assert server.url.startswith("http://127.0.0.1:")
    x = np.zeros((1, 3, TINY_SIZE, TINY_SIZE), np.float32)
    body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32",
                                   "shape": list(x.shape), "data": x.ravel().tolist()}]})
    answer: dict = {}

    def send() -> None:
        request = urllib.request.Request(f"{server.url}/v2/models/tiny/infer",
                                         data=body.encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                answer["status"] = response.status
                answer["body"] = json.loads(response.read())
        except Exception as exc:  # reported by the assertion below
            answer["error"] = exc

    client = threading.Thread(target=send)
    client.start()
    try:
        assert wait_until(lambda: _pending(server.url) == 1.0), server.log
        server.process.send_signal(signal.SIGTERM)
        client.join(60)
        assert answer.get("status") == 200, (answer, server.log)
        assert answer["body"]["outputs"][0]["shape"] == [1, 255, 2, 2]
        assert server.process.wait(60) == 0, server.log
    finally:
        server.stop()
    host, port = server.address.split(":")
    with socket.socket() as probe:
        assert probe.connect_ex((host, int(port))) != 0, "still listening after exit"


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "darknet_metal", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_bad_repository_is_an_error_naming_it(tmp_path):
    done = _serve(str(tmp_path / "nowhere"), "--port", "0")
    assert done.returncode == 1
    assert f"{tmp_path / 'nowhere'}: model repository not found" in done.stderr
    add_tiny(tmp_path, config="max_batch_size: 1\nbogus: 1\n")
    done = _serve(str(tmp_path), "--port", "0")
    assert done.returncode == 1
    assert f"{tmp_path / 'tiny' / 'config.pbtxt'}:2:" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_taken_port_is_an_error_naming_it(tmp_path):
    add_tiny(tmp_path, config="max_batch_size: 1\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = _serve(str(tmp_path), "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_errors_of_the_command_line(tmp_path):
    done = _serve(str(tmp_path), "--port", "70000")
    assert done.returncode == 2 and "is not a TCP port" in done.stderr
    done = _serve(str(tmp_path), "--max-body-mb", "0")
    assert done.returncode == 2


def test_the_demo_page_and_unknown_routes(tmp_path):
    add_tiny(tmp_path, config="max_batch_size: 1\n")
    with ServerProcess(tmp_path, "-q") as server:
        with urllib.request.urlopen(server.url + "/", timeout=30) as response:
            assert response.headers["Content-Type"].startswith("text/html")
            assert b"darknet-metal" in response.read()
        try:
            urllib.request.urlopen(server.url + "/v3", timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404 and "error" in json.loads(exc.read())
        else:
            raise AssertionError("/v3 answered")


def test_accepted_connections_do_not_wait_for_delayed_acks():
    """Nagle's algorithm on the server's connections holds the second part of an answer
    until the client's delayed ACK (40 ms): the listening socket must make asyncio set
    TCP_NODELAY on each connection it accepts."""
    import asyncio

    from darknet_metal.serving.server import open_socket

    async def check() -> int:
        flags: list[int] = []

        def connected(reader, writer):
            sock = writer.get_extra_info("socket")
            flags.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = open_socket("127.0.0.1", 0)
        server = await asyncio.start_server(connected, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not flags:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()
        return flags[0]

    assert asyncio.run(asyncio.wait_for(check(), 30)) != 0
