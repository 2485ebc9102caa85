"""The server's name: host:port once serve says where it listens, host:pid<pid> before."""
import os
import socket
import subprocess
import sys

import pytest

from engines.server import server_identity


@pytest.fixture
def restored_port():
    before = server_identity._port
    yield
    server_identity._port = before


def test_a_server_told_its_port_is_host_port(restored_port) -> None:
    server_identity.configure(8123)
    assert server_identity.server_id() == f"{socket.gethostname()}:8123"
    server_identity.configure(8124)  # a restart on another port is another server
    assert server_identity.server_id() == f"{socket.gethostname()}:8124"


def test_without_a_port_it_names_its_process(restored_port) -> None:
    server_identity._port = None
    assert server_identity.server_id() == f"{socket.gethostname()}:pid{os.getpid()}"
    assert server_identity.host_of(server_identity.server_id()) == socket.gethostname()  # as of host:port


def test_a_bare_asgi_server_names_its_port_in_the_environment() -> None:
    code = ("import django; django.setup(); from engines.server.server_identity import server_id, fleet_name; "
            "print(server_id(), fleet_name())")
    env = {**os.environ, "ENGINES_PORT": "9001", "FLEET_NAME": "blue", "DJANGO_SETTINGS_MODULE": "debugsite.settings"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{socket.gethostname()}:9001", "blue"]


@pytest.mark.parametrize("url, named", [
    ("http://gpu-7:8000/", "gpu-7:8000"), ("http://10.0.0.5:9000/v1", "10.0.0.5:9000"),
    ("https://mlc.example.org", "mlc.example.org:443"), ("http://Box", "box:80"), ("http://[::1]:8001/", "[::1]:8001")])
def test_a_server_known_by_url_is_its_host_and_port(url: str, named: str) -> None:
    assert server_identity.url_server_id(url) == named
