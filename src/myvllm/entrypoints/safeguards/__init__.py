"""What keeps one client from hurting the server or the other clients: the API key, bounded
connections, deadlines for slow clients, per-request limits, answer-size bounds, and error logs
that cannot flood."""
