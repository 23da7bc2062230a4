output "zone_id" {
  description = "The hosted zone's id."
  value       = data.aws_route53_zone.this.zone_id
}

output "record_fqdn" {
  description = "The service name, as Route53 holds it."
  value       = distinct([for r in aws_route53_record.latency : r.fqdn])
}

output "health_check_ids" {
  description = "Health check id per balancer id."
  value       = { for id, hc in aws_route53_health_check.balancer : id => hc.id }
}
