"""What this machine is: its platform, what its Jetson files say, the CPUs it may use, and the
settings a process of the agent makes for itself on it."""
