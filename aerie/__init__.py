"""Aerie's shared package: what every process needs and what clients import (configuration,
endpoints, messages and their codec, the transport, process bootstrap, the default model and
the ZMQ client). It imports nothing from the process packages.
"""
