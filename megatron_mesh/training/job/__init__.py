"""The job's process: devices, process groups, host-staged CP, the console; shared with generation."""
