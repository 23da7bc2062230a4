# Route53 latency records, one per balancer, each guarded by a health check on /health
# (SkyLB section 4.1: one name, resolved to the nearest healthy regional balancer).
#
# Use this module OR the controller's `skymesh dns sync` for a given record name, not
# both: the two would fight over the same set identifiers.

data "aws_route53_zone" "this" {
  name         = var.zone_name
  private_zone = false
}

locals {
  balancers = { for b in var.balancers : b.id => b }
}

resource "aws_route53_health_check" "balancer" {
  for_each = local.balancers

  ip_address        = each.value.ip
  port              = each.value.port
  type              = var.health_check_type
  resource_path     = var.health_check_path
  request_interval  = var.request_interval
  failure_threshold = var.failure_threshold

  tags = merge(var.tags, {
    Name                 = "skymesh ${each.key}"
    "skymesh:balancer"   = each.key
    "skymesh:managed-by" = "terraform"
  })
}

resource "aws_route53_record" "latency" {
  #checkov:skip=CKV2_AWS_23:Records point at the balancers' Elastic IPs, which live in other providers' regions
  for_each = local.balancers

  zone_id         = data.aws_route53_zone.this.zone_id
  name            = var.record_name
  type            = "A"
  ttl             = var.ttl
  records         = [each.value.ip]
  set_identifier  = each.key
  health_check_id = aws_route53_health_check.balancer[each.key].id

  latency_routing_policy {
    region = each.value.region
  }
}
