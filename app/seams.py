"""Every reach into faust's and aiokafka's private internals, in one place.

Each seam names the upstream code it depends on and why the public API does not
suffice; tests/unit/app/test_seams.py holds a canary per seam that fails when an
upgrade makes the seam a silent no-op or breaks it. The versions are pinned
exactly in pyproject.toml for the same reason (faust-streaming 0.15.3,
aiokafka 0.14.0, mode-streaming 0.7.1).

The seams:

- :func:`install_wait_topic_visible`: patches faust's
  ``Transport._really_create_topic`` to return once every broker knows the
  topic it created (on a cluster, the worker subscribes to it right after).
- :func:`cluster_metadata`: aiokafka's ``AIOKafkaConsumer._client`` and
  ``AIOKafkaClient.fetch_all_metadata`` (partition counts of any topic).
- :func:`admin_request`: aiokafka's ``AIOKafkaAdminClient._send_request``
  (CreateAcls has a request class but no public admin method).
- :func:`send_raw`: faust's transport ``Producer.send``, called with its six
  positional parameters (public, but positional: a reordering would swap
  fields silently).

The scoring path (app/eos.py), the feedback loop and the merchant tally
(app/at_least_once.py) run on librdkafka's public API and need none: no faust
stream or table carries a worker's records.
faust is imported inside the seams that need it, never at module level: the
gateway and the tools import this module (through app/topics.py) and do not
otherwise load faust.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

__all__ = ["admin_request", "cluster_metadata", "install_wait_topic_visible", "send_raw"]


# --- faust's own topics, visible before it subscribes to them --------------------------------------

#: How long a created topic may take to reach every broker's metadata before
#: faust goes on anyway (KRaft brokers apply the controller's record in
#: milliseconds to a few hundred; a loaded 2-core machine is the slow case).
TOPIC_VISIBLE_WAIT_S = 15.0


def install_wait_topic_visible() -> None:
    """Make faust's topic creation return only once every broker has the topic.

    Upstream: faust-streaming 0.15.3, ``faust.transport.drivers.aiokafka.
    Transport._really_create_topic`` (behind ``Transport.create_topic``, which
    declares the changelog, repartition and assignor topics at start).

    NOTE: on a KRaft cluster CreateTopics answers once the controller has the
    topic; each broker learns it a moment later. faust subscribes to the
    topics it just declared, and a consumer whose metadata came from a broker
    that did not know one yet ignores it in the assignment ("Ignoring missing
    topic"): a worker on the 3-node stack then never got its changelog
    partitions and never became ready (measured: no progress in 180 s). On
    one broker the answer and the metadata come from the same node.
    """
    import asyncio
    import time

    from aiokafka.protocol.metadata import MetadataRequest
    from faust.transport.drivers import aiokafka as faust_aiokafka

    transport_cls = faust_aiokafka.Transport
    original = transport_cls._really_create_topic
    if getattr(original, "_fraud_patched", False):
        return

    async def _really_create_topic(self: Any, owner: Any, client: Any, topic: str, *args: Any, **kwargs: Any) -> None:
        await original(self, owner, client, topic, *args, **kwargs)
        deadline = time.monotonic() + TOPIC_VISIBLE_WAIT_S
        nodes = [broker.nodeId for broker in client.cluster.brokers()]
        while nodes and time.monotonic() < deadline:
            missing = []
            for node in nodes:
                try:
                    response = await client.send(node, MetadataRequest([topic]))
                    known = any(t[1] == topic and t[0] == 0 for t in response.topics)
                except Exception:  # a broker that cannot answer now: asked again
                    known = False
                if not known:
                    missing.append(node)
            nodes = missing
            if nodes:
                await asyncio.sleep(0.05)
        if nodes:
            owner.log.warning("topic %r not yet known to brokers %s", topic, nodes)

    _really_create_topic._fraud_patched = True  # type: ignore[attr-defined]
    transport_cls._really_create_topic = _really_create_topic  # type: ignore[method-assign]


# --- metadata -------------------------------------------------------------------------------------


async def cluster_metadata(consumer: Any) -> Any:
    """Metadata of every topic of the cluster (a ``ClusterMetadata``).

    Upstream: aiokafka 0.14.0, ``AIOKafkaConsumer._client`` (its
    ``AIOKafkaClient``) and ``AIOKafkaClient.fetch_all_metadata``.

    NOTE: a consumer without a subscription tracks no topics, so its public
    ``partitions_for_topic`` stays None until it is assigned partitions, which
    needs their numbers first. tests/integration/test_gateway.py and
    test_autoscale_broker.py fail too if this stops working.
    """
    return await consumer._client.fetch_all_metadata()


# --- producing ------------------------------------------------------------------------------------


async def admin_request(admin: Any, request: Any) -> Any:
    """Send a request the admin client has no public method for (CreateAcls).

    Upstream: aiokafka 0.14.0, ``aiokafka.admin.AIOKafkaAdminClient._send_request``
    (the helper every public admin method uses: picks a broker, sends, returns
    the response). aiokafka has ``CreateAclsRequest`` in its protocol but no
    ``create_acls``; the secure local stack needs it to apply its ACL table.
    """
    response = await admin._send_request(request)
    return response


async def send_raw(producer: Any, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
    """Hand one record to faust's transport producer, to be partitioned by key;
    returns its delivery future (``RecordMetadata``).

    Upstream: faust-streaming 0.15.3, ``faust.transport.drivers.aiokafka.
    Producer.send(topic, key, value, partition, timestamp, headers, *, transactional_id)``.

    NOTE: public, but every parameter but ``transactional_id`` is positional
    and required: a reordering upstream would swap key and value silently.
    ``Topic.send`` would be the documented path; app/produce.py says why it is
    bypassed.
    """
    result: Awaitable[Any] = await producer.send(topic, key, value, None, None, None)
    return result
