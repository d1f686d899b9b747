"""A node's MirrorNeuron id. MirrorNeuron names a node ``mirror_neuron@192.168.4.20`` (its Erlang node name: a
prefix, ``@``, the host); mn-prefect names it as its worker registered it (``gpu-1``). The id is
``mirror_neuron@<host>``, the host being the node's ``mn.address`` label when it has one, else its name."""

from __future__ import annotations

from mn_prefect.model.node import NodeRecord

ADDRESS_LABEL = "mn.address"
PREFIX = "mirror_neuron"


def host_of(node: NodeRecord) -> str:
    return node.labels.get(ADDRESS_LABEL) or node.name


def mirror_neuron_id(node: NodeRecord) -> str:
    return f"{PREFIX}@{host_of(node)}"
