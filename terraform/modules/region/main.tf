# One SkyMesh region: network, balancers (each an Auto Scaling group of one holding an
# Elastic IP, so Route53 and peers have a stable address while the group replaces a dead
# instance), and optionally emulated replicas on fixed private addresses.
#
# Every instance installs SkyMesh from the operator's wheel (var.skymesh_wheel_url, S3 or
# HTTPS), never from a package name on PyPI. Replicas live in a private subnet whose only
# way out is a NAT gateway (apt and the wheel's dependencies), plus a free S3 gateway
# endpoint so the wheel itself does not cross the NAT.

data "aws_region" "current" {}

data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:Subnets take the first N zones by index; a zone AWS adds later does not move them
  state = "available"
}

data "aws_caller_identity" "current" {}

# Looked up only when the operator names no AMI (an AWS API emulator, or a region without
# Debian's images, has none to find).
data "aws_ami" "debian" {
  count       = var.ami_id == null ? 1 : 0
  most_recent = true
  owners      = [var.ami_owner]
  filter {
    name   = "name"
    values = ["debian-12-amd64-*"]
  }
}

locals {
  create_vpc   = var.vpc_id == null
  vpc_id       = local.create_vpc ? aws_vpc.this[0].id : var.vpc_id
  subnet_ids   = local.create_vpc ? aws_subnet.public[*].id : var.subnet_ids
  ami_id       = var.ami_id != null ? var.ami_id : data.aws_ami.debian[0].id
  mesh         = var.certs_ssm_prefix != null
  tls          = var.tls_ssm_prefix != null
  balancer_id  = [for i in range(var.balancer_count) : "lb-${var.name}-${i}"]
  tags         = merge(var.tags, { "skymesh:region" = var.name })
  wheel_in_s3  = startswith(var.skymesh_wheel_url, "s3://")
  wheel_sha256 = var.skymesh_wheel_sha256 != null ? var.skymesh_wheel_sha256 : ""
  pip_args     = var.pip_index_url != null ? "--index-url ${var.pip_index_url}" : ""
  # arn:aws:s3:::bucket/key from s3://bucket/key (only read when the wheel is in S3).
  wheel_s3_arn = "arn:aws:s3:::${trimprefix(var.skymesh_wheel_url, "s3://")}"
  # An emulated replica installs two wheels, the data plane's and skymesh-replica's
  # (install-skymesh.sh takes them space-separated, with one hash per wheel or none).
  replica_wheels  = compact([var.skymesh_wheel_url, var.skymesh_replica_wheel_url])
  replica_sha256  = join(" ", compact([var.skymesh_wheel_sha256, var.skymesh_replica_wheel_sha256]))
  replica_s3_arns = [for u in local.replica_wheels : "arn:aws:s3:::${trimprefix(u, "s3://")}" if startswith(u, "s3://")]

  # Emulated replicas sit on fixed addresses of their (private) subnet, so the balancers'
  # configuration can list them.
  private_replicas  = local.create_vpc && var.replica_count > 0
  replica_subnet_id = local.private_replicas ? aws_subnet.private[0].id : coalesce(var.replica_subnet_id, local.subnet_ids[0])
  replica_cidr      = local.private_replicas ? cidrsubnet(var.vpc_cidr, 8, 100) : one(data.aws_subnet.replica[*].cidr_block)
  replica_ips       = [for i in range(var.replica_count) : cidrhost(local.replica_cidr, 20 + i)]
  replicas = concat(
    [for u in var.replica_urls : { url = u, kind = var.replica_kind }],
    [for ip in local.replica_ips : { url = "http://${ip}:8001", kind = "skymesh" }],
  )

  # skymesh-lb's configuration (skymesh/balancer/config.py); one per balancer id.
  lb_config = [for id in local.balancer_id : merge(
    {
      region = var.name
      listen = merge({ host = "0.0.0.0", port = var.lb_port }, local.tls ? {
        tls = { cert_file = "/etc/skymesh/tls/edge.crt", key_file = "/etc/skymesh/tls/edge.key" }
      } : {})
      auth     = { api_keys_file = "/etc/skymesh/api-keys" }
      policy   = { name = var.policy, params = {} }
      pushing  = { mode = "sp-p" }
      probe    = { interval_s = 0.1, failure_threshold = 3, success_threshold = 2 }
      replicas = local.replicas
    },
    local.mesh ? {
      mesh = {
        id          = id
        certs_dir   = "/etc/skymesh/pki"
        listen_host = "0.0.0.0"
        listen_port = var.peering_port
        peers       = var.mesh_peers
        forwarding  = true
        peer_policy = "prefix-tree"
        tau         = 2
      }
    } : {},
  )]

  install_script = file("${path.module}/../../../deploy/cloud-init/install-skymesh.sh")
  units = {
    "skymesh-lb.service"      = file("${path.module}/../../../deploy/systemd/skymesh-lb.service")
    "skymesh-replica.service" = file("${path.module}/../../../deploy/systemd/skymesh-replica.service")
  }
}

# -- network -----------------------------------------------------------------------------

resource "aws_vpc" "this" {
  count                = local.create_vpc ? 1 : 0
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = "skymesh-${var.name}" })
}

resource "aws_default_security_group" "this" {
  # No rules: nothing may use the VPC's default group by accident.
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = local.tags
}

resource "aws_flow_log" "this" {
  count                = local.create_vpc ? 1 : 0
  vpc_id               = aws_vpc.this[0].id
  traffic_type         = "REJECT"
  log_destination_type = "cloud-watch-logs"
  log_destination      = aws_cloudwatch_log_group.flow[0].arn
  iam_role_arn         = aws_iam_role.flow[0].arn
  tags                 = local.tags
}

resource "aws_cloudwatch_log_group" "flow" {
  #checkov:skip=CKV_AWS_158:Flow logs of rejected packets only; the default encryption of CloudWatch Logs is enough
  #checkov:skip=CKV_AWS_338:A week of rejected-packet logs is what debugging needs
  count             = local.create_vpc ? 1 : 0
  name              = "/skymesh/${var.name}/vpc-flow"
  retention_in_days = 7
  tags              = local.tags
}

resource "aws_iam_role" "flow" {
  count = local.create_vpc ? 1 : 0
  name  = "skymesh-${var.name}-flow-${data.aws_region.current.name}"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "vpc-flow-logs.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
  tags = local.tags
}

resource "aws_iam_role_policy" "flow" {
  count = local.create_vpc ? 1 : 0
  name  = "write-flow-logs"
  role  = aws_iam_role.flow[0].id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect   = "Allow"
      Action   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
      Resource = "${aws_cloudwatch_log_group.flow[0].arn}:*"
    }]
  })
}

resource "aws_internet_gateway" "this" {
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = local.tags
}

resource "aws_subnet" "public" {
  count             = local.create_vpc ? var.availability_zones : 0
  vpc_id            = aws_vpc.this[0].id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, count.index)
  availability_zone = data.aws_availability_zones.available.names[count.index]
  # Balancers get Elastic IPs; nothing else here needs a public address.
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "skymesh-${var.name}-public-${count.index}" })
}

resource "aws_route_table" "public" {
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }
  tags = local.tags
}

resource "aws_route_table_association" "public" {
  count          = local.create_vpc ? var.availability_zones : 0
  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public[0].id
}

# Replicas: a private subnet whose default route is a NAT gateway in the first public
# subnet (one gateway per region: emulated replicas are for trying the mesh, not for
# zone-level availability), and an S3 gateway endpoint for the wheel.
resource "aws_subnet" "private" {
  count             = local.private_replicas ? 1 : 0
  vpc_id            = aws_vpc.this[0].id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 100)
  availability_zone = data.aws_availability_zones.available.names[0]
  tags              = merge(local.tags, { Name = "skymesh-${var.name}-replicas" })
}

resource "aws_eip" "nat" {
  #checkov:skip=CKV2_AWS_19:The NAT gateway holds this address
  count  = local.private_replicas ? 1 : 0
  domain = "vpc"
  tags   = merge(local.tags, { Name = "skymesh-${var.name}-nat" })
}

resource "aws_nat_gateway" "this" {
  count         = local.private_replicas ? 1 : 0
  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = "skymesh-${var.name}" })
  depends_on    = [aws_internet_gateway.this]
}

resource "aws_route_table" "private" {
  count  = local.private_replicas ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  route {
    cidr_block     = "0.0.0.0/0"
    nat_gateway_id = aws_nat_gateway.this[0].id
  }
  tags = local.tags
}

resource "aws_route_table_association" "private" {
  count          = local.private_replicas ? 1 : 0
  subnet_id      = aws_subnet.private[0].id
  route_table_id = aws_route_table.private[0].id
}

resource "aws_vpc_endpoint" "s3" {
  count             = local.create_vpc ? 1 : 0
  vpc_id            = aws_vpc.this[0].id
  service_name      = "com.amazonaws.${data.aws_region.current.name}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = concat(aws_route_table.public[*].id, aws_route_table.private[*].id)
  tags              = local.tags
}

# An existing VPC: the operator's subnet (var.replica_subnet_id) must already reach apt
# and the package index.
data "aws_subnet" "replica" {
  count = local.private_replicas || var.replica_count == 0 ? 0 : 1
  id    = local.replica_subnet_id
}

# -- security ----------------------------------------------------------------------------

resource "aws_security_group" "lb" {
  name        = "skymesh-lb-${var.name}"
  description = "skymesh-lb: HTTP edge and gRPC peering"
  vpc_id      = local.vpc_id
  tags        = local.tags

  ingress {
    description = "OpenAI API, /health for Route53, /metrics"
    from_port   = var.lb_port
    to_port     = var.lb_port
    protocol    = "tcp"
    cidr_blocks = var.client_cidrs #checkov:skip=CKV_AWS_260:The balancer is the public endpoint of the service
  }

  ingress {
    description = "gRPC peering between regions (mutual TLS)"
    from_port   = var.peering_port
    to_port     = var.peering_port
    protocol    = "tcp"
    cidr_blocks = var.peer_cidrs
  }

  egress {
    description = "Replicas, peers, package index, AWS APIs"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"] #checkov:skip=CKV_AWS_382:Peers in other regions and the package index are anywhere
  }
}

resource "aws_security_group" "replica" {
  count       = var.replica_count > 0 ? 1 : 0
  name        = "skymesh-replica-${var.name}"
  description = "skymesh-replica: reachable from the balancers only"
  vpc_id      = local.vpc_id
  tags        = local.tags

  ingress {
    description     = "Replica API from the balancers"
    from_port       = 8001
    to_port         = 8001
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  egress {
    description = "apt, the wheel and its dependencies at boot (HTTPS, through the NAT gateway)"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  egress {
    description = "apt mirrors that serve plain HTTP (packages are signed)"
    from_port   = 80
    to_port     = 80
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# The balancer's instance role: claim its Elastic IP, read its mesh certificates and the
# wheel, mark itself unhealthy (the watchdog in user_data.sh.tftpl).
resource "aws_iam_role" "lb" {
  name = "skymesh-lb-${var.name}-${data.aws_region.current.name}"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
  tags = local.tags
}

resource "aws_iam_role_policy" "lb" {
  name = "skymesh-lb"
  role = aws_iam_role.lb.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [{
        Effect = "Allow"
        Action = ["ec2:AssociateAddress"]
        Resource = concat(
          [for e in aws_eip.lb : "arn:aws:ec2:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:elastic-ip/${e.allocation_id}"],
          ["arn:aws:ec2:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:instance/*"],
        )
      }],
      local.mesh ? [{
        Effect   = "Allow"
        Action   = ["ssm:GetParameter"]
        Resource = "arn:aws:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${var.certs_ssm_prefix}/*"
      }] : [],
      [{
        Effect   = "Allow"
        Action   = ["ssm:GetParameter"]
        Resource = "arn:aws:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${var.api_keys_ssm_param}"
      }],
      local.tls ? [{
        Effect   = "Allow"
        Action   = ["ssm:GetParameter"]
        Resource = "arn:aws:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${var.tls_ssm_prefix}/*"
      }] : [],
      [{
        Effect   = "Allow"
        Action   = ["autoscaling:SetInstanceHealth"]
        Resource = [for id in local.balancer_id : "arn:aws:autoscaling:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:autoScalingGroup:*:autoScalingGroupName/${id}"]
      }],
      local.wheel_in_s3 ? [{
        Effect   = "Allow"
        Action   = ["s3:GetObject"]
        Resource = local.wheel_s3_arn
      }] : [],
    )
  })
}

resource "aws_iam_instance_profile" "lb" {
  name = "skymesh-lb-${var.name}-${data.aws_region.current.name}"
  role = aws_iam_role.lb.name
}

# -- balancers ---------------------------------------------------------------------------

resource "aws_eip" "lb" {
  #checkov:skip=CKV2_AWS_19:Each balancer claims its Elastic IP at boot (install-skymesh.sh), so the Auto Scaling group can replace it
  count  = var.balancer_count
  domain = "vpc"
  tags   = merge(local.tags, { Name = local.balancer_id[count.index] })
}

resource "aws_launch_template" "lb" {
  #checkov:skip=CKV_AWS_88:The balancer is the public endpoint Route53 answers with (it then claims its Elastic IP)
  count         = var.balancer_count
  name_prefix   = "${local.balancer_id[count.index]}-"
  image_id      = local.ami_id
  instance_type = var.instance_type

  iam_instance_profile {
    arn = aws_iam_instance_profile.lb.arn
  }

  network_interfaces {
    # The Elastic IP replaces this address once the instance claims it at boot.
    associate_public_ip_address = true
    security_groups             = [aws_security_group.lb.id]
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required" # IMDSv2 only
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size = 16
      encrypted   = true
    }
  }

  # gzip: the script embeds the units and the installer, and EC2 takes at most 16 KiB of
  # user data; cloud-init unpacks gzip itself (tests/deploy/test_user_data_size.py).
  user_data = base64gzip(templatefile("${path.module}/user_data.sh.tftpl", {
    roles          = "lb"
    wheel_url      = var.skymesh_wheel_url
    wheel_sha256   = local.wheel_sha256
    pip_args       = local.pip_args
    watchdog_url   = "${local.tls ? "https" : "http"}://127.0.0.1:${var.lb_port}/health"
    asg_name       = local.balancer_id[count.index]
    install_script = local.install_script
    units          = { "skymesh-lb.service" = local.units["skymesh-lb.service"] }
    configs        = { "lb.yaml" = yamlencode(local.lb_config[count.index]) }
    eip_allocation = aws_eip.lb[count.index].allocation_id
    certs_prefix   = local.mesh ? var.certs_ssm_prefix : ""
    mesh_id        = local.balancer_id[count.index]
    api_keys_param = var.api_keys_ssm_param
    tls_prefix     = local.tls ? var.tls_ssm_prefix : ""
  }))

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { Name = local.balancer_id[count.index], "skymesh:role" = "lb" })
  }
}

resource "aws_autoscaling_group" "lb" {
  count            = var.balancer_count
  name             = local.balancer_id[count.index]
  min_size         = 1
  desired_capacity = 1
  # One instance per group; max 2 lets an instance refresh start the new one before it
  # stops the old (the new one takes over the Elastic IP at boot).
  max_size            = 2
  vpc_zone_identifier = local.subnet_ids
  # The balancers sit behind Route53 and their own Elastic IPs, not a load balancer, so
  # there is no target group to take health from. Instead the instance's watchdog
  # (user_data.sh.tftpl) polls skymesh-lb's /health and, after 3 failures in a row, calls
  # SetInstanceHealth(Unhealthy): the group then replaces the instance. systemd restarts
  # a crashed daemon first (Restart=on-failure); the watchdog catches a hung one or a
  # crash loop. The grace period covers the first boot's install.
  health_check_type         = "EC2"
  health_check_grace_period = var.health_check_grace_period

  launch_template {
    id      = aws_launch_template.lb[count.index].id
    version = aws_launch_template.lb[count.index].latest_version
  }

  instance_refresh {
    strategy = "Rolling"
    preferences {
      # Launch the replacement first, stop the old one once it is healthy.
      min_healthy_percentage = 100
      max_healthy_percentage = 200
      instance_warmup        = var.health_check_grace_period
    }
  }

  dynamic "tag" {
    for_each = merge(local.tags, { Name = local.balancer_id[count.index] })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}

# -- optional emulated replicas ------------------------------------------------------------

resource "aws_iam_role" "replica" {
  count = var.replica_count > 0 ? 1 : 0
  name  = "skymesh-replica-${var.name}-${data.aws_region.current.name}"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
  tags = local.tags
}

# Emulated replicas call no AWS API but S3, for the wheel.
resource "aws_iam_role_policy" "replica" {
  count = var.replica_count > 0 && length(local.replica_s3_arns) > 0 ? 1 : 0
  name  = "read-wheel"
  role  = aws_iam_role.replica[0].id
  policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Action = ["s3:GetObject"], Resource = local.replica_s3_arns }]
  })
}

resource "aws_iam_instance_profile" "replica" {
  count = var.replica_count > 0 ? 1 : 0
  name  = "skymesh-replica-${var.name}-${data.aws_region.current.name}"
  role  = aws_iam_role.replica[0].name
}

resource "aws_instance" "replica" {
  count                  = var.replica_count
  ami                    = local.ami_id
  instance_type          = var.replica_instance_type
  iam_instance_profile   = aws_iam_instance_profile.replica[0].name
  subnet_id              = local.replica_subnet_id
  private_ip             = local.replica_ips[count.index]
  vpc_security_group_ids = [aws_security_group.replica[0].id]
  monitoring             = var.detailed_monitoring
  ebs_optimized          = true

  metadata_options {
    http_endpoint = "enabled"
    http_tokens   = "required"
  }

  root_block_device {
    volume_size = 16
    encrypted   = true
  }

  # Boot-time installs need the NAT route (apt, the wheel's dependencies) and the S3
  # endpoint (the wheel) in place.
  depends_on = [aws_route_table_association.private, aws_vpc_endpoint.s3]

  lifecycle {
    precondition {
      condition     = var.skymesh_replica_wheel_url != null
      error_message = "Emulated replicas (replica_count > 0) install skymesh_replica_wheel_url too: set it."
    }
    precondition {
      condition     = var.skymesh_replica_wheel_sha256 != null
      error_message = "Emulated replicas install skymesh_replica_wheel_url: give its skymesh_replica_wheel_sha256 too (a fetched wheel is installed only when its hash matches)."
    }
  }

  # gzip, as the balancers' (EC2's 16 KiB limit; cloud-init unpacks it).
  user_data_base64 = base64gzip(templatefile("${path.module}/user_data.sh.tftpl", {
    roles          = "replica"
    wheel_url      = join(" ", local.replica_wheels)
    wheel_sha256   = local.replica_sha256
    pip_args       = local.pip_args
    watchdog_url   = ""
    asg_name       = ""
    install_script = local.install_script
    units          = { "skymesh-replica.service" = local.units["skymesh-replica.service"] }
    configs        = { "replica.env" = "SKYMESH_REPLICA_ARGS=--host 0.0.0.0 --port 8001 --profile ${var.replica_profile}\n" }
    eip_allocation = ""
    certs_prefix   = ""
    mesh_id        = ""
    api_keys_param = ""
    tls_prefix     = ""
  }))

  tags = merge(local.tags, { Name = "skymesh-replica-${var.name}-${count.index}", "skymesh:role" = "replica" })
}
