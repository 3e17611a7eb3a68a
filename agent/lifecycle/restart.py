"""The exit code with which the agent asks to be started again (a configuration that needs a restart,
an agent release switched): non-zero, so systemd's ``Restart=on-failure`` restarts it (EX_TEMPFAIL).

Its own module, importing nothing: the stdlib-only launcher reads it too.
"""

RESTART_EXIT_CODE = 75
