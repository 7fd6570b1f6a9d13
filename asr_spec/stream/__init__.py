"""Live transcription: audio streams in, stable text streams out (policy.py: the pure per-stream policy;
agreement.py: its token arithmetic; decodes.py: the one many-streams runner, through an engine session, for the
CLI and the server; driver.py: the CLI's and API's streams over it; catchup.py: a stream that is behind)."""
