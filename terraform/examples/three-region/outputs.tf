output "endpoint" {
  description = "The service URL: Route53 answers with the nearest healthy balancer."
  value       = "http://${var.record_name}:8080"
}

output "balancers" {
  description = "Every balancer: id, public IP, URL, peering address, AWS region."
  value       = local.balancers
}

output "asg_names" {
  description = "The balancers' Auto Scaling groups, per region."
  value = {
    us-east      = module.us_east.asg_names
    eu-west      = module.eu_west.asg_names
    ap-northeast = module.ap_northeast.asg_names
  }
}

output "health_check_ids" {
  description = "Route53 health check per balancer id."
  value       = module.dns.health_check_ids
}

output "controller_regions" {
  description = "Bodies for the controller's POST /v1/regions (cloud_region makes `skymesh dns sync` work too)."
  value = [
    { name = "us-east", latitude = 38.9, longitude = -77.0, cloud_region = module.us_east.cloud_region },
    { name = "eu-west", latitude = 53.3, longitude = -6.3, cloud_region = module.eu_west.cloud_region },
    { name = "ap-northeast", latitude = 35.7, longitude = 139.7, cloud_region = module.ap_northeast.cloud_region },
  ]
}
