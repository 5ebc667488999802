"""What the planner prices beyond a dense layer: the workload, mixed layers, document
lengths, any mask from its slices (windows and placed documents in closed form), and the
kernel calls one rank makes."""
