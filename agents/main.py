"""A module-level app for faust's own CLI: ``faust -A agents.main worker -l info``.

``fraud-pipeline worker`` is the usual entry point; this exists because
operators who know faust reach for its command first. Importing it loads the
model and rules and creates the topics, so import it only to run a worker.
"""

from __future__ import annotations

import asyncio

from agents.wiring import create_app
from app.settings import get_settings
from app.topics import ensure_topics

settings = get_settings()
asyncio.run(ensure_topics(settings))
app = create_app(settings)
