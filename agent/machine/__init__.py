"""What this machine is: its platform, what its Jetson files say, and the CPUs it may use."""
