"""The bottom layer, shared by attention/, models/, scheduler/ and engine/, importing none of them:
process groups (distributed), host-device copies (transfer), request sampling parameters
(sampling_params), the torch elementwise glue of a layer (fused) and the kernel plan
(kernel_plan)."""
