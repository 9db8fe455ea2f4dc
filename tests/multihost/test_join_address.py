"""The address a process joins Ray with (`cluster.launcher.address_toward`): its interface on the
route to the head, so that a driver on a host without a route out is registered on its own
host's node (the five-host module checks a router on a decode host end to end)."""

import pytest

from cluster.launcher import address_toward


def test_the_interface_on_the_route_to_the_head():
    assert address_toward("127.0.0.1:6379") == "127.0.0.1"
    assert address_toward("localhost:6379") == "127.0.0.1"


@pytest.mark.parametrize("address", ["auto", "ray://10.0.0.1:10001", "10.0.0.1", "10.0.0.1:port",
                                     "no-such-host.invalid:6379"])
def test_addresses_ray_resolves_itself_are_left_to_it(address):
    assert address_toward(address) is None
