output "cloud_region" {
  description = "The AWS region this module deployed into."
  value       = data.aws_region.current.name
}

output "vpc_id" {
  description = "The VPC the balancers run in."
  value       = local.vpc_id
}

output "balancers" {
  description = "One entry per balancer: id, public IP, client port, its URL (https with tls_ssm_prefix), peering address."
  value = [for i, id in local.balancer_id : {
    id     = id
    ip     = aws_eip.lb[i].public_ip
    port   = var.lb_port
    region = data.aws_region.current.name
    url    = "${local.tls ? "https" : "http"}://${aws_eip.lb[i].public_ip}:${var.lb_port}"
    peer   = "${aws_eip.lb[i].public_ip}:${var.peering_port}"
  }]
  # Only the Elastic IPs: the other regions' launch templates are built from this output,
  # so anything derived from a launch template here (the Auto Scaling group) would be a
  # cycle across the modules.
}

output "asg_names" {
  description = "The balancers' Auto Scaling groups (one per balancer id)."
  value       = aws_autoscaling_group.lb[*].name
}

output "lb_security_group_id" {
  description = "Security group of the balancers."
  value       = aws_security_group.lb.id
}

output "replica_urls" {
  description = "Every replica the balancers serve from."
  value       = [for r in local.replicas : r.url]
}
